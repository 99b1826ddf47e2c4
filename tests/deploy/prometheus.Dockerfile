# A Prometheus image built offline for tests/deploy/test_containers.py: Debian's prometheus
# binary (from `apt-get download prometheus`, unpacked into the build context by the test) on the
# locally made Debian base. It stands in for prom/prometheus, which cannot be pulled here.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY usr/bin/prometheus /usr/bin/prometheus
RUN install -d -o nobody -g nogroup /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
