# The balancer of docker-compose.replicas.yml: HAProxy from Debian's own package, on the same
# base as phi2-server's image (python:3.11-slim is Debian bookworm: HAProxy 2.6 LTS, kept up
# to date by Debian's security updates). Build: make docker-replicas (README, "Deploying").
FROM python:3.11-slim

# Debian's current stable package is the point: pinning one version would break the build at
# its next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*

COPY deploy/haproxy.cfg /usr/local/etc/haproxy/haproxy.cfg
# The package made this user (its uid is the package's choice): not root.
# hadolint ignore=DL3066
USER haproxy
EXPOSE 8000 8404
CMD ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg", "-db"]
