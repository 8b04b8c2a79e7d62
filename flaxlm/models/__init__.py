"""Model families; importing this package registers them with Gin and with `hf_spec`.

Every family module of this package is imported here, so a new family is its file alone
(and a gin/models/ file): nothing lists the families.
"""

import importlib
import pkgutil

from flaxlm.models.base import (  # noqa: F401
    BaseModel,
    ComputeOptions,
    DecoderOnlyModel,
    EncoderDecoderModel,
    EncoderOnlyModel,
)
from flaxlm.models.causal_lm import CausalLM  # noqa: F401

# All but `features` (the seqio converters, with TensorFlow): the input pipeline and the Gin
# files that name a converter import it; a model computes without it.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "features":
        importlib.import_module(f"{__name__}.{_module.name}")
