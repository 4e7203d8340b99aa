# Prometheus from Debian's package, with pstrain's scrape configuration and
# alert rules (deploy/prometheus/), for deploy/compose/compose.yaml:
#   podman build --format docker -f deploy/compose/prometheus.Dockerfile -t pstrain-prometheus .
ARG BASE=debian:bookworm-slim
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
COPY deploy/prometheus/prometheus.yml deploy/prometheus/alerts.yml /etc/prometheus/
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=0.0.0.0:9090"]
