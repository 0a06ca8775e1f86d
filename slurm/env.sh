# Sourced by the sbatch scripts in this folder: the environment every rank of a megatron-rl job gets.
# Edit here for your cluster; each line says when it applies.

# Logs and checkpoints must be on storage every node sees (runs/ under the submit directory by
# default; set logging.run_dir=/shared/... otherwise). Slurm's own output goes to logs/.
mkdir -p logs

# One CUDA connection per device so that tensor/context-parallel communication is issued before the
# compute it overlaps with: needed on Ampere and Hopper (A100, H100, H200) with TP or CP > 1
# (megatron-core's requirement). Leave it unset on Blackwell (B200, GB200; GPU_ARCH=blackwell).
if [[ "${GPU_ARCH:-hopper}" != blackwell ]]; then
    export CUDA_DEVICE_MAX_CONNECTIONS=1
fi

# NCCL. InfiniBand H100 clusters: the HCAs and the bootstrap interface are site-specific, e.g.
#   export NCCL_IB_HCA=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11
#   export NCCL_SOCKET_IFNAME=bond0
# GB200 NVL72 (aarch64, 4 GPUs a node, 18 nodes a rack over NVLink): NCCL finds the multi-node
# NVLink domain itself; keep the IMEX daemon running on the nodes (the cluster's job), and
#   export NCCL_NVLS_ENABLE=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# train.py reads rank, world size and local rank from SLURM_* and the master from the first host of
# SLURM_NODELIST; one port per job, so that jobs sharing a node do not collide.
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
export PYTHONUNBUFFERED=1
