"""Fashion-MNIST: the demo (heterogeneous-width CNNs, HeteroAvg, Dirichlet 0.5).

    python -m experiments.fmnist                    # the demo, ~2.5 min on a 2-core CPU
    python -m experiments.fmnist --method FedAvg    # per-architecture-group baseline
    python -m experiments.fmnist --help
"""

from fedjax_hetero.cli.run import main
from fedjax_hetero.run.interruption import the_process_is_a_command

if __name__ == "__main__":
  the_process_is_a_command()
  main("fashion_mnist")
