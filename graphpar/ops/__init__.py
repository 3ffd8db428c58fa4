"""The operator library: importing it registers every operator into `graphpar.core.schema`.

Every module of this package is imported here (discovered, not listed), so a new op module is picked
up by adding the file; `common` holds the helpers op modules share and registers nothing.
"""

import importlib
import pkgutil

OP_MODULES = tuple(sorted(info.name for info in pkgutil.iter_modules(__path__)))

for _name in OP_MODULES:
    importlib.import_module(f"{__name__}.{_name}")
