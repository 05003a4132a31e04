"""weightsync: declarative, observable, fast RL weight synchronisation on Kubernetes."""

__version__ = "0.1.0"
