"""Weight sync: the trainer's new weights, resharded from Megatron's TP x PP layout into SGLang."""

from megatron_dapo.weight_sync.metrics import SyncMetrics
from megatron_dapo.weight_sync.syncer import ROUTES, WeightSyncer, make_weight_syncer

__all__ = ["ROUTES", "SyncMetrics", "WeightSyncer", "make_weight_syncer"]
