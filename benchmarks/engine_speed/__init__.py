"""Engine throughput: lightning_gpipe against torch.distributed.pipelining and single-process references."""
