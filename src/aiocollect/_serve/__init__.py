"""Serving envs and policies over WebSocket: ``serve_envs``/``RemoteEnv``/``RemoteVectorEnv``,
``serve_policy``/``RemotePolicy``.

The wire is documented in ``docs/serve.md``: binary frames of a JSON header and raw array bytes, a shared
token checked in the handshake, never a pickle from the network. Needs the ``serve`` extra (wsproto).
"""

from ._env_server import EnvServer, serve_envs
from ._policy_server import PolicyServer, serve_policy
from ._process import EnvServerProcess, serve_envs_process
from ._remote_env import RemoteEnv
from ._remote_policy import RemotePolicy
from ._remote_pool import PooledRemoteEnv, RemoteEnvPool
from ._remote_vector import RemoteVectorEnv
from ._ws import RemoteConnectionError

__all__ = [
    "EnvServer",
    "EnvServerProcess",
    "PolicyServer",
    "PooledRemoteEnv",
    "RemoteConnectionError",
    "RemoteEnv",
    "RemoteEnvPool",
    "RemotePolicy",
    "RemoteVectorEnv",
    "serve_envs",
    "serve_envs_process",
    "serve_policy",
]
