"""Environments exactly as each platform sets them, shared by the detection and build tests."""

SATURN = {
    "SATURN_JOB_SCALE": "2", "SATURN_JOB_RANK": "1",
    "SATURN_JOB_LEADER": "train-0.jobs.team.svc.cluster.local",
    "SATURN_JOB_RUN": "train", "SATURN_INTERNAL_SUBDOMAIN": "jobs", "SATURN_NAMESPACE": "team",
}
SKYPILOT = {
    "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-2026-11-26-abc",
}
SLURM = {
    "SLURM_JOB_ID": "123456", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08],login2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "4",
}
SLURM_PER_TASK = {  # srun --ntasks-per-node=4: each task is a worker
    "SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "3", "SLURM_PROCID": "7",
}
KUBEFLOW = {
    "PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4",
    "MASTER_ADDR": "pj-master-0", "MASTER_PORT": "23456",
    "RANK": "1", "WORLD_SIZE": "2",  # pod index and pod count under Kubeflow
}
TORCHRUN_WORKER = {
    "TORCHELASTIC_RUN_ID": "none", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400",
}
# Open MPI 4.1's mpirun sets the job id below in every process of one job.
MPI_PER_NODE = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_MCA_ess_base_jobid": "137297921", "MASTER_ADDR": "10.2.0.1"}
MPI_PER_GPU = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "6",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
               "OMPI_MCA_ess_base_jobid": "137297921", "MASTER_ADDR": "10.2.0.1"}
SAGEMAKER = {"SM_HOSTS": '["algo-1","algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "8",
             "TRAINING_JOB_NAME": "sm-job"}
GENERIC = {"MASTER_ADDR": "head.example", "MASTER_PORT": "6000", "NNODES": "2", "NODE_RANK": "1"}
# IBM LSF with jsrun (CSM): LSB_MCPU_HOSTS starts with the launch node's one slot.
LSF_PER_NODE = {"LSB_JOBID": "1234", "LSB_MCPU_HOSTS": "batch1 1 c01n01 42 c01n02 42",  # jsrun -r 1 -a 1
                "JSM_NAMESPACE_SIZE": "2", "JSM_NAMESPACE_RANK": "1", "JSM_NAMESPACE_LOCAL_RANK": "0",
                "JSM_NAMESPACE_LOCAL_SIZE": "1"}
LSF_PER_GPU = {"LSB_JOBID": "1234", "LSB_MCPU_HOSTS": "batch1 1 c01n01 42 c01n02 42",  # jsrun -r 1 -a 4
               "JSM_NAMESPACE_SIZE": "8", "JSM_NAMESPACE_RANK": "6", "JSM_NAMESPACE_LOCAL_RANK": "2",
               "JSM_NAMESPACE_LOCAL_SIZE": "4"}
# A PyTorchJob without PET_* (no nprocPerNode): WORLD_SIZE pods, RANK this pod's index.
KUBEFLOW_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_PORT": "tcp://10.96.0.1:443",
                "MASTER_ADDR": "pj-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
                "PYTHONUNBUFFERED": "0"}
