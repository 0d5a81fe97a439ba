"""The old home of FedImpro's pure pieces, kept as an import path: they live in
`fedjax_hetero.methods.fedimpro` with the method's term and step."""

import sys

from fedjax_hetero.methods import fedimpro as _home

sys.modules[__name__] = _home
