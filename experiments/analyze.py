"""``python -m experiments.analyze``: `fedjax_hetero.cli.analyze` (also ``fedjax-hetero analyze``)."""

from fedjax_hetero.cli.analyze import main

if __name__ == "__main__":
  main()
