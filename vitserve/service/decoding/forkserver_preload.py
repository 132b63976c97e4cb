"""What the decode pool's fork server imports before it forks a worker: the workers' code (decode.py), and SIGTERM
and SIGINT left to the server (signals.leave_to_owner), for the fork server and every worker it forks. The fork
server exits on its own when the server is gone."""

from ..ground.signals import leave_to_owner
from . import decode  # noqa: F401

leave_to_owner()
