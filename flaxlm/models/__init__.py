"""Model families; importing this package registers them with Gin."""

from flaxlm.models import (  # noqa: F401
    base,
    gemma,  # noqa: F401
    gpt2,  # noqa: F401
    gptj,
    layers,
    llama,  # noqa: F401
    opt,  # noqa: F401
    roberta,  # noqa: F401
    t5,  # noqa: F401
)
from flaxlm.models.base import (  # noqa: F401
    BaseModel,
    DecoderOnlyModel,
    EncoderDecoderModel,
    EncoderOnlyModel,
)
from flaxlm.models.gptj import GPTJ, GPTJConfig  # noqa: F401
