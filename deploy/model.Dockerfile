# A qil image with a model baked in, for clusters without a shared volume for /models. Build the
# base image (deploy/Dockerfile) first, then, with the directory that holds the checkpoint as the
# build context:
#
#   docker build -f deploy/model.Dockerfile --build-arg BASE_IMAGE=qil:cuda \
#       --build-arg MODEL_DIR=Qwen3-0.6B -t qil:qwen3-0.6b-cuda /path/to/models
#
# The files stay owned by root: the server (uid 10001) only reads them.
ARG BASE_IMAGE=qil:cpu
FROM ${BASE_IMAGE}
ARG MODEL_DIR=model
COPY ${MODEL_DIR} /models/model
