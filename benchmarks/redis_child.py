"""The benchmarks' throwaway redis-server and its CPU counter, from the package (`rlstream sim` uses them too).

Imported as a script sibling (benchmarks/ is sys.path[0]).
"""

from rlstream.launcher.redis_child import RedisChild
from rlstream.sim.redis_stats import redis_cpu

__all__ = ["RedisChild", "redis_cpu"]
