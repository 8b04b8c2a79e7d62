"""Model families; importing this package registers them with Gin and with `hf_spec`.

Every family module of this package is imported here, so a new family is its file alone
(and a gin/models/ file): nothing lists the families.
"""

import importlib
import pkgutil

# All but `features` (the seqio converters, with TensorFlow): the input pipeline and the Gin
# files that name a converter import it; a model computes without it.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "features":
        importlib.import_module(f"{__name__}.{_module.name}")
