"""Everything that talks to Redis: keys, admission, versions + events, the trajectory stream, step log,
producer records, name-resolve records, inspect.

Every operation is written once as a plan (`broker/plan.py`) and run by a thin sync or
asyncio runner: `AdmissionController` / `AsyncAdmissionController`, `VersionRegistry` /
`AsyncVersionRegistry`. `rlstream.broker.inspect` (read-only queries for `rlstream
inspect`) and `rlstream.broker.registry` (name resolve) are imported on demand.
"""

from rlstream.broker.admission import AdmissionController, AdmissionState, AsyncAdmissionController, Lease
from rlstream.broker.connection import BrokerAuthError, BrokerError, BrokerUnavailable, connect, connect_async, mask_url
from rlstream.broker.keys import TRAIN_GROUP, Keys, namespace
from rlstream.broker.meta import RunMeta, read_run_meta, write_run_meta
from rlstream.broker.stream import Entry, TrajectoryStream, entry_fields
from rlstream.broker.steps import StepLog, StepRecord
from rlstream.broker.versions import AsyncVersionRegistry, Event, VersionRegistry

__all__ = [
    "AdmissionController", "AdmissionState", "AsyncAdmissionController", "Lease",
    "BrokerAuthError", "BrokerError", "BrokerUnavailable", "connect", "connect_async", "mask_url",
    "TRAIN_GROUP", "Keys", "namespace",
    "RunMeta", "read_run_meta", "write_run_meta",
    "Entry", "TrajectoryStream", "entry_fields",
    "StepLog", "StepRecord",
    "AsyncVersionRegistry", "Event", "VersionRegistry",
]
