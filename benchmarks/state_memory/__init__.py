"""Each rank's resident memory and time through loading, the first step, saving and resuming, per checkpoint format."""
