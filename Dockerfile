# The tollgate image, built from source: every role is the same binary.
#   docker build -t tollgate .
# Needs a registry for the base images. Without one (CI, air-gapped hosts),
# scripts/build-images packages a locally built binary into a FROM scratch image.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tollgate-cli \
 && install -D target/release/tollgate /out/tollgate

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tollgate /usr/local/bin/tollgate
# No config inside: mount one and name it with TOLLGATE_CONFIG (docker-compose
# mounts deploy/tollgate.toml); without one the built-in config applies.
USER nonroot
ENTRYPOINT ["/usr/local/bin/tollgate"]
