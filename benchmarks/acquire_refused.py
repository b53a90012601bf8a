"""Redis command time of an acquisition the budget refuses, by how many leases it asks for.

    python benchmarks/acquire_refused.py                       # this tree's acquisition script
    PYTHONPATH=/path/to/old python benchmarks/acquire_refused.py   # another tree's (a folder holding `rlstream`)

A producer asks for leases in batches (`try_acquire_many`, 1 doubling up to 32): the last call of a burst asks
for more than is left and most of its leases are refused. Against a throwaway redis-server: the budget is used
up by a filler owner, 32 other producers were refused just before (they count as waiting), and one producer
asks for n leases `--calls` times back to back; every call must be refused. Reported: the EVALSHA command time
per call (INFO commandstats), median of `--rounds` rounds. Run it for two trees alternately to compare scripts.
"""

from __future__ import annotations

import argparse
import statistics

from redis_child import RedisChild  # benchmarks/ is sys.path[0]

WAITING = 32  # other producers refused just before (the 256-engine setting's 32 producers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,8,32", help="leases per call, comma-separated")
    ap.add_argument("--calls", type=int, default=400, help="calls per round and size")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from rlstream.broker import AdmissionController, Keys, connect
    from rlstream.broker import admission

    server = RedisChild()
    try:
        client = connect(server.url)
        keys = Keys("rlstream:acqref:t")

        def controller(owner: str) -> AdmissionController:
            return AdmissionController(client, keys, max_head_offpolicyness=0, consumer_batch_size=256,
                                       max_concurrent_rollouts=10**6, owner=owner, lease_ttl=3600.0)

        filler = controller("filler")
        while any(lease for _, lease in filler.try_acquire_many(32)):
            pass  # the budget (B = 256) is used up
        for i in range(WAITING):
            assert controller(f"waiting{i}").try_acquire_many(1)[0][1] is None  # refused: waiting
        me = controller("me")
        out = {}
        for n in (int(x) for x in args.sizes.split(",")):
            per_round = []
            for _ in range(args.rounds):
                client.config_resetstat()
                for _ in range(args.calls):
                    if any(lease for _, lease in me.try_acquire_many(n)):
                        raise SystemExit("a lease was granted: the budget did not stay used up")
                st = client.info("commandstats")["cmdstat_evalsha"]
                per_round.append(st["usec"] / st["calls"])
            out[n] = statistics.median(per_round)
        print(f"{admission.__file__}: EVALSHA us per refused call by leases asked: "
              + ", ".join(f"{n}: {us:.1f}" for n, us in out.items()))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
