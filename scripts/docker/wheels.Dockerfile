# The torch wheels of a local folder as an image, for the Dockerfile's TORCH_WHEELS_IMAGE:
#
#   docker build -t rlstream-torch-wheels -f scripts/docker/wheels.Dockerfile /opt/wheels
#
# The image is only mounted during the build; nothing of it lands in the rlstream image.
FROM scratch
COPY torch-*.whl /
