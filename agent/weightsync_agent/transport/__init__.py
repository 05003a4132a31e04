"""How bytes reach a target: the interface (``base``) and its implementations.

``mooncake`` (Mooncake Transfer Engine: TCP, RDMA, NVLink), ``memory`` (in-process, for tests and
demos), ``collective`` + ``assemble`` (torch.distributed, for broadcast mode). Nothing is imported here,
so that using one transport never loads another's heavy dependencies. See docs/transport.md.
"""
