"""Analysis tools: linear CKA, loss landscapes, BatchNorm re-estimation and figures.

InCo spec Sec. 5, FedCross spec Sec. 5.
"""

from fedjax_hetero.analysis.batch_norm import batch_norm_momenta, recalibrate_batch_stats
from fedjax_hetero.analysis.cka import cka_matrix, layer_similarity, linear_cka, plot_cka, stage_outputs
from fedjax_hetero.analysis.landscape import (LossSurface, filter_normalized_direction, loss_surface,
                                              plot_loss_landscapes)
from fedjax_hetero.analysis.plots import (plot_client_bubbles, plot_inco_tracking, plot_similarity_tracking,
                                          plot_update_histograms)

__all__ = [
    "LossSurface", "batch_norm_momenta", "cka_matrix", "filter_normalized_direction", "layer_similarity", "linear_cka",
    "loss_surface", "plot_cka", "plot_client_bubbles", "plot_inco_tracking", "plot_loss_landscapes",
    "plot_similarity_tracking", "plot_update_histograms", "recalibrate_batch_stats", "stage_outputs",
]
