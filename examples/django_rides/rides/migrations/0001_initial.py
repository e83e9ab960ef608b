from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    # Django's migration format: class attributes it reads.
    dependencies = [migrations.swappable_dependency(settings.AUTH_USER_MODEL)]  # noqa: RUF012

    operations = [  # noqa: RUF012
        migrations.CreateModel(
            name="Ride",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("origin", models.CharField(max_length=200)),
                ("target", models.CharField(max_length=200)),
                ("key_id", models.BigIntegerField(unique=True)),
                ("charge_id", models.CharField(max_length=100, null=True)),
                (
                    "user",
                    models.ForeignKey(on_delete=models.PROTECT, to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
        migrations.CreateModel(
            name="AuditRecord",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("action", models.CharField(max_length=50)),
                ("key_id", models.BigIntegerField()),
                (
                    "user",
                    models.ForeignKey(on_delete=models.PROTECT, to=settings.AUTH_USER_MODEL),
                ),
            ],
        ),
    ]
