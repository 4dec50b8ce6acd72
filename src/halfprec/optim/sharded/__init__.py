"""The sharded strategy (ZeRO-1/2): ``ShardedMixedPrecisionOptimizer`` shards masters, optimizer state and (stage 2)
gradients over data-parallel ranks. Public as ``halfprec.distributed.ShardedMixedPrecisionOptimizer``."""

from .optimizer import DEFAULT_BUCKET_SIZE, ShardedMixedPrecisionOptimizer

__all__ = ["DEFAULT_BUCKET_SIZE", "ShardedMixedPrecisionOptimizer"]
