"""Deployment artefacts (xpk, JobSet, PathwaysJob, Slurm) rendered from one parameter set.

    python -m scripts.deploy.render TARGET ...      (render.py: the command line)

The modules, from the parameters up to the command line:

    errors.py            DeployError: parameters that cannot make a working deployment
    tpu.py               TPU slice shapes (--tpu-type)
    params.py            DeployParams: every parameter, its derived values and the checks that refuse bad ones
    trainer_command.py   the trainer argv, built once and checked with the trainer's own config loader
    failure_policy.py    the exit-code contract as podFailurePolicy, JobSet failurePolicy and restart budgets
    graceful_stop.py     the trainer's stop timeout and the grace periods that fit it (and Spot's notice)
    capacity.py          --capacity spot: node selector, toleration, header lines
    resources.py         the trainer container's resources and QoS
    pathways.py          what the Pathways targets share: images, ports, the head's env and logs command
    multiprocess_env.py  the environment and XLA flags of the multi-process targets
    gpu_networking.py    GKE's GPUDirect-TCPXO and -RDMA setups (--gpu-networking)
    manifest.py          Kubernetes objects as dicts dumped with PyYAML; metadata and env helpers
    shell_template.py    the `{{name}}` templates of the shell scripts (templates/)
    artefact.py          Rendered (what a target returns) and the comment header of every artefact
    targets/             one module per target (jobset_pathways, pathwaysjob, xpk, jobset_gpu, slurm) and
                         RENDERERS / render(target, params)
    render.py            the command line: arguments, `all`, writing the files
"""
