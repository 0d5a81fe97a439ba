"""``python -m experiments.launch``: `fedjax_hetero.cli.launch` (also ``fedjax-hetero launch``)."""

from fedjax_hetero.cli.launch import main

if __name__ == "__main__":
  raise SystemExit(main())
