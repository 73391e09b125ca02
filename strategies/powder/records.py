"""What Powder adds to the wire."""

from ..platform.replies import MetricSpec
from ..platform.statistics import Statistics

#: reply record: measured alphas (empty when the server did not ask)
ALPHA = "powder-alpha"
#: config keys of a train message
LOCAL_TASKS = "powder-tasks"
MEASURE = "powder-measure"
CLASS_CORR = "powder-class-corr"
PREVIOUS = "powder-previous"
OWN_WEIGHTS = "powder-own-weights"
#: the metrics record of a reply to the measuring exchange (learner.py)
MEASURE_METRICS = {"num-examples": MetricSpec(int, low=0)}

#: what the platform bounds where the run is defended (stats-bound), in replies and in the
#: answers to the measuring exchange; the counts are of the samples measured on every task in
#: the client's pool, not of the reply's training examples, so no count bound applies to them
STATISTICS = {ALPHA: Statistics(vectors=("task-alpha", "class-alpha"))}
