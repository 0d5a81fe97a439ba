"""Datasets (uint8 NHWC numpy arrays) and client partitioning."""

from fedjax_hetero.data.datasets import (
    DATASETS,
    ArrayDataset,
    DataNotFoundError,
    load_dataset,
    load_fashion_mnist,
    load_tfds,
    resize_images,
    synthetic_dataset,
)
from fedjax_hetero.data.partition import (
    SCHEMES,
    class_counts,
    dirichlet,
    hold_out,
    iid,
    iid_imbalanced,
    load_partition_file,
    partition,
    partition_report,
    plot_partition,
    save_partition_file,
    shards,
)

__all__ = [
    "DATASETS",
    "SCHEMES",
    "ArrayDataset",
    "DataNotFoundError",
    "class_counts",
    "dirichlet",
    "hold_out",
    "iid",
    "iid_imbalanced",
    "load_dataset",
    "load_fashion_mnist",
    "load_partition_file",
    "load_tfds",
    "partition",
    "partition_report",
    "plot_partition",
    "resize_images",
    "save_partition_file",
    "shards",
    "synthetic_dataset",
]
