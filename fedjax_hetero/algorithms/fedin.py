"""The old home of FedIN's pure pieces, kept as an import path: they live in
`fedjax_hetero.methods.fedin` with the method's term and step."""

import sys

from fedjax_hetero.methods import fedin as _home

sys.modules[__name__] = _home
