"""Fashion-MNIST: the demo (heterogeneous-width CNNs, HeteroAvg, Dirichlet 0.5).

    python -m experiments.fmnist                    # the demo, ~5 min on a 2-core CPU
    python -m experiments.fmnist --method FedAvg    # per-architecture-group baseline
    python -m experiments.fmnist --help
"""

from experiments.cli import main, preset

DEMO = preset(dataset="fashion_mnist", output_dir="runs/fmnist")

if __name__ == "__main__":
  main("fashion_mnist", DEMO, __doc__.splitlines()[0])
