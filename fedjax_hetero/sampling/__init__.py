"""Client sampling schemes beyond uniform (see `fedjax_hetero.data.store.sample_clients`)."""

from fedjax_hetero.sampling.clustered import (AGGREGATION_SCHEMES, COLD_STARTS, ClusteredSampler, flatten_update,
                                              pairwise_dissimilarity, similarity_clusters, size_clusters,
                                              weight_clusters)

__all__ = [
    "AGGREGATION_SCHEMES", "COLD_STARTS", "ClusteredSampler", "flatten_update",
    "pairwise_dissimilarity", "similarity_clusters", "size_clusters", "weight_clusters",
]
