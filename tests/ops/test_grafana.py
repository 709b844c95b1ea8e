"""The monitoring profile's Grafana is provisioned from docker/grafana/: the data source its dashboard names exists,
the dashboard folder is where the provider looks, and compose mounts both there."""

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "docker" / "grafana"


def test_grafana_is_provisioned_with_the_dashboard_and_its_data_source() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["grafana"]
    assert compose["profiles"] == ["monitoring"]
    mounts = dict(volume.removesuffix(":ro").split(":", 1)[::-1] for volume in compose["volumes"])
    assert mounts["/etc/grafana/provisioning"] == "./docker/grafana/provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "eagle3.yml").read_text())["providers"][0]
    dashboards_dir = provider["options"]["path"]
    assert mounts[dashboards_dir] == "./docker/grafana/dashboards"
    assert compose["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dashboards_dir}/eagle3.json"

    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((GRAFANA / "dashboards" / "eagle3.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10
    for panel in panels:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] and t["expr"] for t in panel["targets"]), panel["title"]
