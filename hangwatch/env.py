"""Every environment variable hangwatch reads or sets that is not one of its
settings, named exactly once (a setting's variable is derived from its field
name: `hangwatch.config.env_var`).

Code elsewhere imports these constants; nothing spells an env var name inline.
"""

from __future__ import annotations

# --- hangwatch's own settings: HANGWATCH_<FIELD> for each field of
# hangwatch.config's sections, derived there (config.env_var), never spelled here.

# Set by `hangwatch run` so the sitecustomize shim attaches the hook with no
# edit of the training script.
HANGWATCH_AUTOATTACH = "HANGWATCH_AUTOATTACH"
# Set by the hook: the torch variables it gave a default (comma-separated), so
# a process started under one (torchrun's workers, under torchrun's hook) does
# not announce hangwatch's own default as "the job's" value.
HANGWATCH_TORCH_DEFAULTS = "HANGWATCH_TORCH_DEFAULTS"

# --- torch's variables that the hook sets defaults for (and logs overrides of) ---
TORCH_FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
TORCH_NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
TORCH_FR_DUMP_TEMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"
TORCH_NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
TORCH_NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
# torch 2.15's names, read before the TORCH_NCCL_* ones.
TORCH_FR_DUMP_ON_TIMEOUT = "TORCH_FR_DUMP_ON_TIMEOUT"
TORCH_INCLUDE_STACK_TRACE = "TORCH_INCLUDE_STACK_TRACE"
# torch reads each of these settings under the first name that is set, in this order.
DUMP_ON_TIMEOUT_NAMES = (TORCH_FR_DUMP_ON_TIMEOUT, TORCH_NCCL_DUMP_ON_TIMEOUT)
DUMP_FILE_NAMES = (TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE)

# --- torchrun's per-process variables the hook reads ---
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
# Rendezvous address for env:// init; the hang-zoo launcher sets them per job.
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
PYTHONPATH = "PYTHONPATH"

# --- the compiled test backend's build (hangwatch.testing.hookbackend) ---
# Where built extensions are kept (default: $XDG_CACHE_HOME/hangwatch/ext).
HANGWATCH_EXT_CACHE = "HANGWATCH_EXT_CACHE"
XDG_CACHE_HOME = "XDG_CACHE_HOME"
# The C++ compiler torch's cpp_extension uses (default c++).
CXX = "CXX"
