"""Model families; importing this package registers them with Gin and with `hf_spec`."""

from flaxlm.models import (  # noqa: F401
    attention,
    base,
    causal_lm,
    features,
    gpt2,
    gptj,
    hf_spec,
    layers,
    llama,
    opt,
    roberta,
    t5,
)
from flaxlm.models.base import (  # noqa: F401
    BaseModel,
    ComputeOptions,
    DecoderOnlyModel,
    EncoderDecoderModel,
    EncoderOnlyModel,
)
from flaxlm.models.causal_lm import CausalLM  # noqa: F401
from flaxlm.models.gptj import GPTJ, GPTJConfig  # noqa: F401
