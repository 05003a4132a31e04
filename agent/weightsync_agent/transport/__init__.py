"""How bytes reach a target: the interface (``base``) and its implementations.

``mooncake`` (Mooncake Transfer Engine: TCP, RDMA, NVLink), ``local`` (in-process, for tests and
demos), ``broadcast`` + ``assemble`` (torch.distributed broadcast mode). Nothing is imported here, so
that using one transport never loads another's heavy dependencies. See docs/transport.md.
"""
