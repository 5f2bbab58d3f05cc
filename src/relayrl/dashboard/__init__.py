"""`relayrl dashboard`: a live page of a run's metrics (reward, staleness, throughput, queue depth)."""

from relayrl.dashboard.server import DashboardServer, MetricsChunk, read_metrics_chunk

__all__ = ["DashboardServer", "MetricsChunk", "read_metrics_chunk"]
