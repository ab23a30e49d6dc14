"""The wheel's `torchrun.handlers` entry point ("zeroshard").

torch loads its handler plugins while it imports torch.distributed.elastic.rendezvous,
which importing torch.distributed.checkpoint does. So this module imports nothing of
torch nor of zeroshard.torch (which imports torch.distributed.checkpoint, half
imported at that moment: a circular import, #44 finding 10); zeroshard.torchrun, the
handler itself, is imported when torchrun makes a handler, after every import is done.
"""


def _create_handler(params):
    from zeroshard.torchrun import ZeroshardRendezvousHandler

    return ZeroshardRendezvousHandler(params)


def handler_factory():
    """torch calls it and registers what it returns: the function that makes a handler
    from torchrun's rendezvous parameters."""
    return _create_handler
