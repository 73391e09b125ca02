"""What Powder adds to the wire."""

from ..platform.replies import MetricSpec

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
