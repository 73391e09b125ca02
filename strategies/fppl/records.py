"""What FPPL adds to the wire, and how differential privacy bounds what a client uploads."""

from ...common.privacy import PrivateRecord
from ..platform.statistics import Statistics

#: client -> server: this client's per-class mean features ("classes", "means", "counts", "client")
LOCAL_PROTOTYPES = "prototypes"
#: server -> client: global prototypes of the current task's classes ("classes", "means")
GLOBAL_PROTOTYPES = "global-prototypes"

#: dp.clip = C: each class prototype (a mean feature) is clipped to norm C on its own;
#: classes, counts and the client id are the label histogram and bookkeeping, in the clear
PRIVATE_RECORDS = {LOCAL_PROTOTYPES: PrivateRecord(bounded={"means": (1, 1.0)}, public=("classes", "counts", "client"))}

#: what the platform bounds where the run is defended (stats-bound)
STATISTICS = {LOCAL_PROTOTYPES: Statistics(vectors=("means",), counts=("counts",))}
