"""Datasets (uint8 NHWC numpy arrays) and client partitioning."""

from fedjax_hetero.data.datasets import (
    DATASETS,
    ArrayDataset,
    DataNotFoundError,
    load_dataset,
    load_fashion_mnist,
    load_tfds,
    synthetic_dataset,
)
from fedjax_hetero.data.partition import (
    SCHEMES,
    class_counts,
    dirichlet,
    iid,
    iid_imbalanced,
    partition,
    partition_report,
    plot_partition,
    shards,
)

__all__ = [
    "DATASETS",
    "SCHEMES",
    "ArrayDataset",
    "DataNotFoundError",
    "class_counts",
    "dirichlet",
    "iid",
    "iid_imbalanced",
    "load_dataset",
    "load_fashion_mnist",
    "load_tfds",
    "partition",
    "partition_report",
    "plot_partition",
    "shards",
    "synthetic_dataset",
]
