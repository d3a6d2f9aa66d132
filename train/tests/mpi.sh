#!/bin/sh
# Tests of the MPI backend: builds ckpt-train with `--features mpi` and runs
# tests/mpi.rs, which starts itself under `mpirun -n 2` and `-n 4` (--oversubscribe)
# and checks collectives and training bit for bit against the thread backend, resume
# across backends, and that a dead, failing or stuck rank ends the job in bounded time.
#
# Needs Open MPI and libclang (for rsmpi's bindings):
#   apt-get install -y libopenmpi-dev openmpi-bin libclang-dev
set -eu
cd "$(dirname "$0")/../.."
if ! command -v mpirun >/dev/null 2>&1; then
    echo "train/tests/mpi.sh: mpirun not found; apt-get install -y libopenmpi-dev openmpi-bin libclang-dev" >&2
    exit 2
fi
# Containers and CI run as root; Open MPI refuses that unless told.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo test -p ckpt-train --features mpi --lib -- comm::mpi launch
cargo test -p ckpt-train --features mpi --test mpi
