"""Context parallelism: strategies, per-forward metadata, and the pure build_layout."""
from graphcp.cp.layout import CPLayout, build_layout
from graphcp.cp.metadata import CPMetadata
from graphcp.cp.strategy import ContextParallelStrategy, InterleaveStrategy, ZigzagStrategy, make_strategy

__all__ = ["CPLayout", "build_layout", "CPMetadata", "ContextParallelStrategy", "InterleaveStrategy",
           "ZigzagStrategy", "make_strategy"]
