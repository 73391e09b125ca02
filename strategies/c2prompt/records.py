"""What C2Prompt adds to the wire, and how differential privacy bounds what a client uploads."""

from ...common.privacy import PrivateRecord
from ..platform.replies import MetricSpec
from ..platform.statistics import DIAGONAL, Statistics

#: client -> server: per-class statistics of the frozen backbone's q(x) ("classes", "counts",
#: "means", "var": diagonal population variances); empty when the server did not ask
CLASS_STATS = "c2prompt-stats"
#: client -> server: the histogram H (prompted block x component of the task's slice x class of the
#: task, in the order of ``TaskLayout.classes``) of prompt selections, "hist"
HISTOGRAM = "c2prompt-hist"
#: server -> client: the global class distributions of the task's classes ("classes", "means", "var")
GLOBAL_STATS = "c2prompt-global"
#: config key of a train message (stats-round = "first-training") or of the statistics-only
#: exchange before training ("exchange"): whether the client uploads its class statistics
UPLOAD_STATS = "c2prompt-upload-stats"
#: config key of a train message with cpa-pool = "keep-all": which part of its task's slice the
#: client trains (its schedule slot: part k is rows k N .. (k + 1) N - 1 of the slice)
PART = "c2prompt-part"
#: the metrics of an answer to the statistics-only exchange: the samples its statistics count
EXCHANGE_METRICS = {"num-examples": MetricSpec(int, low=0)}

# With dp.clip = C the client clips every q(x) to norm C before its statistics (learner.py), so a
# class mean has norm <= C and the population variance, trace mean ||x||^2 - ||mu||^2 <= C^2, has
# a diagonal of L2 norm <= C^2. A histogram layer (one row per prompted block) is clipped to norm 1:
# CPA reads only its direction (cosine similarity) and each client's shares of it, which scaling
# keeps. Classes and counts are the label histogram, sent in the clear.
PRIVATE_RECORDS = {
    CLASS_STATS: PrivateRecord(bounded={"means": (1, 1.0), "var": (2, 1.0)}, public=("classes", "counts")),
    HISTOGRAM: PrivateRecord(bounded={"hist": (0, 1.0)}),
}

#: what the platform bounds where the run is defended (stats-bound). Not the histogram: CPA reads
#: only its rows' directions (cosines) and each client's shares of its own selections, so its
#: scale changes nothing, while bounding a row against other clients' rows rescales an honest
#: label-skewed client's rows unevenly (their norms spread 9.7x in a clean offline run) and with
#: them its shares; check_records keeps it finite (CPA clips negative counts: DP noise makes some)
STATISTICS = {CLASS_STATS: Statistics(vectors=("means",), second_moments={"var": DIAGONAL}, counts=("counts",),
                                      keys="classes"),
              HISTOGRAM: Statistics()}  # declared, nothing of it bounded (above)
