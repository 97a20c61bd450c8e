# ppd-router in a container: build the abi3 wheel with the Rust toolchain, then run it on a
# slim Python image that has no compiler at all.
#   docker build -t ppd-router:0.1.0 .
#   docker run --rm -p 8000:8000 ppd-router:0.1.0 serve --host 0.0.0.0 --emulated 2P2pD

FROM rust:1-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/maturin && /opt/maturin/bin/pip install -q "maturin>=1.7,<2"
WORKDIR /src
COPY . .
# --locked: the wheel is built from Cargo.lock exactly, as CI tests it.
RUN /opt/maturin/bin/maturin build --release --locked -o /dist

FROM python:3.12-slim
COPY --from=build /dist/*.whl /tmp/
RUN pip install --no-cache-dir /tmp/*.whl && rm /tmp/*.whl
# A numeric user, so that Kubernetes' runAsNonRoot can check it.
USER 10001
EXPOSE 8000
ENTRYPOINT ["ppd-router"]
CMD ["--help"]
