"""Training throughput of the zoo's models, pipelined and not, against torch.distributed.pipelining and torchgpipe."""
