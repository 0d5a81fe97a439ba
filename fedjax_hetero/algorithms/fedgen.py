"""The old home of FedGen's pure pieces, kept as an import path: see `fedjax_hetero.methods.fedgen_generator`."""

import sys

from fedjax_hetero.methods import fedgen_generator as _home

sys.modules[__name__] = _home
