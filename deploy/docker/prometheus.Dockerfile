# The Prometheus image of docker-compose.yml's monitoring profile, built when a
# registry is at hand. Without one, `scripts/build-images tollgate:local
# tollgate-redis:local tollgate-prometheus:local` makes the same tag from this
# machine's Debian prometheus.
FROM prom/prometheus:v2.53.0
