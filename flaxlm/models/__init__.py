"""Model families; importing this package registers them with Gin."""

from flaxlm.models import (  # noqa: F401
    base,
    gemma,  # noqa: F401
    gpt2,  # noqa: F401
    gptj,
    layers,
    llama,  # noqa: F401
    opt,  # noqa: F401
    t5,  # noqa: F401
)
from flaxlm.models.base import BaseModel, DecoderOnlyModel  # noqa: F401
from flaxlm.models.gptj import GPTJ, GPTJConfig  # noqa: F401
