"""What PILoRA adds to the wire, and how differential privacy bounds what a client uploads."""

from ...common.privacy import PrivateRecord
from ..platform.statistics import Statistics

#: client -> server: this client's per-class mean features of the round ("classes", "means",
#: "counts": the class's training samples, "client")
CLASS_MEANS = "class-means"

#: dp.clip = C: each class mean (a mean feature) is clipped to norm C on its own, as FPPL's
#: prototypes; classes, counts and the client id are the label histogram and bookkeeping, in the clear
PRIVATE_RECORDS = {CLASS_MEANS: PrivateRecord(bounded={"means": (1, 1.0)}, public=("classes", "counts", "client"))}

#: where the run is defended: class means are vectors (bounded against the round's median norm) with
#: counts, as FPPL's prototypes
STATISTICS = {CLASS_MEANS: Statistics(vectors=("means",), counts=("counts",))}
