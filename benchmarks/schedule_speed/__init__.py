"""Our schedules against torch.distributed.pipelining's own, side by side (``make bench-schedules``)."""
