"""Fashion-MNIST: the demo (heterogeneous-width CNNs, HeteroAvg, Dirichlet 0.5).

    python -m experiments.fmnist                    # the demo, ~2.5 min on a 2-core CPU
    python -m experiments.fmnist --method FedAvg    # per-architecture-group baseline
    python -m experiments.fmnist --help
"""

from experiments.cli import main, preset

# Evaluating the three models on the 10,000 test images costs about as much as two rounds on a 2-core CPU,
# so the demo evaluates every 10 rounds (and after the last).
DEMO = preset(dataset="fashion_mnist", output_dir="runs/fmnist", eval_every=10)

if __name__ == "__main__":
  main("fashion_mnist", DEMO, __doc__.splitlines()[0])
