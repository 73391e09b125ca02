"""What FPPL adds to the wire."""

#: client -> server: this client's per-class mean features ("classes", "means", "counts", "client")
LOCAL_PROTOTYPES = "prototypes"
#: server -> client: global prototypes of the current task's classes ("classes", "means")
GLOBAL_PROTOTYPES = "global-prototypes"
