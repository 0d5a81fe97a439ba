"""``python -m experiments.compare``: `fedjax_hetero.cli.compare` (also ``fedjax-hetero compare``)."""

from fedjax_hetero.cli.compare import main

if __name__ == "__main__":
  main()
