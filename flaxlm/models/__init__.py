"""Model families; importing this package registers them with Gin."""

from flaxlm.models import base, gptj, layers  # noqa: F401
from flaxlm.models.base import BaseModel, DecoderOnlyModel  # noqa: F401
from flaxlm.models.gptj import GPTJ, GPTJConfig  # noqa: F401
